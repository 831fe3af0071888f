"""Coding agents on lucebox: `lucebox launch` runs a real client (Claude Code, Codex, OpenCode, ...) on
`lucebox serve`; `lucebox qualify` checks each client end to end with a scripted model."""
