"""Runs on several processes (cluster join, preemption, the local launcher)
and XLA flags. Imports nothing else of zerojax."""
