"""Helpers shared by the test tiers (no test file imports another)."""
