"""Deadlines, cost estimates, budget, degrade ladder, chunk broker, control clock: plain logic, clock injected."""
