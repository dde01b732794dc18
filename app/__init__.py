"""The Gradio UI and the command line: `app.demo.build_demo(engine, store)` builds the UI from an engine (one
module per tab: library.py for the Documents tab, chat.py, views.py for what attention did); `app.serve` runs it;
`app.cli` is the `squeeze` command. Gradio is imported only where the UI is built, so that `squeeze --help` and the
commands that need no UI do not load it."""
