"""A trained run as a function: chat rendering (templates.py: conversations -> ids and the assistant mask),
the chat session over the key/value cache (chat.py), the serving engine that batches requests (engine.py)
and the OpenAI-compatible HTTP app over it (server.py)."""
