"""The end of an assistant turn where a chat template writes it as text: Laguna's `</assistant>`.

Laguna lists `</assistant>` among its EOS ids, but after tool calls the model may spell it out in
several tokens (llama.cpp stops on the literal string for that reason), and a tokenizer that does not
make it one token never sees the id at all. So a chat request of such a model also stops on the
string (and on the token where there is one), and the APIs report that stop as the model's own end
of turn (finish "stop", Anthropic's end_turn), not as a stop sequence the client asked for.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..sampling import SamplingParams

TURN_ENDS = ("</assistant>",)


@dataclass(frozen=True)
class TurnEnd:
    text: str
    token_id: int | None  # the text as one token of the vocabulary, if it is one

    @classmethod
    def of(cls, tokenizer) -> TurnEnd | None:
        """The turn end the model's chat templates write after an assistant message, if any."""
        templates = " ".join(tokenizer.chat_templates.values())
        text = next((t for t in TURN_ENDS if t in templates), None)
        return None if text is None else cls(text, tokenizer.token_to_id(text))

    def add_to(self, params: SamplingParams) -> set:
        """Adds the turn end to a request's stops (in place: the params are the request's own, and a
        copy would lose which fields the client set); returns what it added."""
        added = set()
        if self.text not in params.stop:
            params.stop.append(self.text)
            added.add(self.text)
        if self.token_id is not None and self.token_id not in params.stop_token_ids:
            params.stop_token_ids.append(self.token_id)
            added.add(self.token_id)
        return added
