"""The engine below the serving layer: the attention step, the methods, the model's forward paths, contexts and
sessions, against full attention and plain transformers."""
