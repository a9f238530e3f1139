"""Adapters that plug srpo's objective into other trainers (verl)."""
