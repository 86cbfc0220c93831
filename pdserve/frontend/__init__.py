"""The OpenAI front end, shared by the co-located worker and the router: request parsing and
validation (`protocol.py`, `fields.py`, a chat's prompt: `chat.py`), the endpoints (`api.py`;
vLLM's /tokenize and /detokenize: `tokenization.py`), prompt ids and their bounds
(`prompts.py`; a client's own chat template renders in `template_jail.py`, if trusted), tool
calls (`tools.py` the fields, `tool_use.py` the parser and the grammar that forces calls,
`tool_answer.py` the answer; the parsers: `tool_calls/`), a call's fan-out and fan-in over a
backend (`generation.py`) and incremental detokenisation (`textstream.py`).
Speaks to an engine or a remote decode worker only through the `Backend` protocol; loads no
torch."""
