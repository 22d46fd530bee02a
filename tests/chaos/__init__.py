"""The fault matrix of issue 8: see README.md here."""
