"""Behaviour cloning of the simulator's expert driver into a checkpoint (`vla-node train`), and in-process closed-loop evaluation."""
