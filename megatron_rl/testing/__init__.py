"""Helpers for the test suite only (Ray worker subclasses); production code never imports this package."""
