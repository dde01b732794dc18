"""What tests build their inputs from: tiny random-weight models (tiny_models.py), PDFs (pdfs.py) and captured keys
(captures.py)."""
