"""Latency reports of a replayed drive: report.json, a terminal summary, a self-contained HTML page."""
