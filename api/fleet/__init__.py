"""The fleet (issue 16): N engine replicas behind one entry point; see README.md here."""
