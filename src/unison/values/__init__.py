"""Distributed values and variables."""
