"""Experiment runner and reports."""
