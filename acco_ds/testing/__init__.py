"""Test oracles. Production code never imports this package."""
