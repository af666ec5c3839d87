"""mmrl."""
