"""Text and tokens: how a document and a chat become the model's input (prompt.py), and real text to build long
inputs from (corpus.py)."""
