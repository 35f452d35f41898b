"""Real training tasks on data that ships offline."""
