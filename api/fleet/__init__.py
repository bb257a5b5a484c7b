"""The fleet: N engine replicas behind one entry point; see README.md here."""
