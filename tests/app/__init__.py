"""The app and the command line: through Gradio's API, a browser, and the `squeeze` command."""
