"""The HTTP server: OpenAI Chat Completions / Completions / Responses and Anthropic Messages.

Protocol code here never touches tensors: it renders prompts, submits requests to the AsyncEngine,
and turns its cumulative outputs into each API's response shapes and SSE events.
Entry points: `lucebox.server.app.create_app` and `lucebox.server.app.serve`.
"""
