"""Built-in persona definitions (Markdown files shipped as package data)."""
