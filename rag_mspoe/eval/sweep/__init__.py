"""The gold-position sweep: the gold document moved through every position, per method."""
