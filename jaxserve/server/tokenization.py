"""POST /tokenize and /detokenize, and GET /tokenizer_info (vLLM's tokenizer routes)."""

from __future__ import annotations

from jaxserve.server.errors import APIError
from jaxserve.server.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.server.serving import OpenAIServing
from jaxserve.tokenizer import render_chat_text


class TokenizationServing(OpenAIServing):
    """The tokenizer's routes."""

    def tokenize(self, body: TokenizeRequest) -> dict:
        """Token ids of a prompt, or of chat messages rendered by the chat template to text and then
        encoded (as vLLM); `token_strs` holds each token's string when asked for."""
        self.models.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        unsupported = body.unsupported_fields()
        if unsupported:
            raise APIError(400, f"{', '.join(unsupported)} is not supported by this server", unsupported[0])
        text = body.prompt if body.messages is None else self._chat_text(body)
        tokens = self.tokenizer.encode(text, add_special_tokens=body.special_tokens())
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"tokens": tokens, "token_strs": token_strs, "count": len(tokens),
                "max_model_len": self.model.max_model_len}

    def _chat_text(self, body: TokenizeRequest) -> str:
        """The text the chat template makes of `body.messages` (400 when it cannot be rendered)."""
        try:
            return render_chat_text(self.tokenizer, [m.for_template() for m in body.messages],
                                    body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
                                    body.tools, self.config.chat_template)
        except (ValueError, TypeError) as error:
            raise APIError(400, f"the chat template cannot render these messages: {error}", "messages") from error

    def tokenizer_info(self) -> dict:
        """The tokenizer's configuration as vLLM's /tokenizer_info gives it: its init arguments without
        file paths, its class and its chat template."""
        config = {name: _json_value(value) for name, value in (self.tokenizer.init_kwargs or {}).items()
                  if name not in ("vocab_file", "merges_file")}
        config["tokenizer_class"] = type(self.tokenizer).__name__
        template = self.config.chat_template or getattr(self.tokenizer, "chat_template", None)
        if template:
            config["chat_template"] = template
        return config

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """Text of token ids."""
        self.models.check_model(body.model)
        vocab_size = self.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"token ids {bad[:8]} are outside the vocabulary [0, {vocab_size})", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}


def _json_value(value: object) -> object:
    """`value` in plain JSON types: special-token objects become their text, anything else unknown its str."""
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    content = getattr(value, "content", None)  # a tokenizers AddedToken
    return content if isinstance(content, str) else str(value)
