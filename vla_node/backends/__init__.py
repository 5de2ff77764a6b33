"""Engines behind one interface: weight formats, CPU feature detection, model loading."""
