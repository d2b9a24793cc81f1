"""A trained run as a function: chat rendering (templates.py: conversations -> ids and the assistant mask),
the chat session over the key/value cache (chat.py) and the OpenAI-compatible HTTP app (server.py)."""
