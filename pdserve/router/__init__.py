"""The router: the OpenAI API in front of a fleet of workers (tokenize, pick, stream, abort)."""
