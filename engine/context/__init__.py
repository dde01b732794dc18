"""A document's context: its settings (settings.py), the ingest that prefills it and builds every asked method's
index (ingest.py), and the session that holds it on the device and answers turns (session.py)."""
