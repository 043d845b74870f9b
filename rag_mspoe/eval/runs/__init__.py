"""The one run loop every evaluation kind goes through: lock, manifest, results file, Ray."""
