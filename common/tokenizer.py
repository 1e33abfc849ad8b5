"""Text <-> token ids for one model directory, with its chat template. No torch, no transformers.

Only the gateway and the offline `generate` command use this; instances are token-in/token-out.
Loads `tokenizer.json` with the `tokenizers` library and renders the chat template with Jinja2 in
a sandbox configured as transformers does (trim_blocks, lstrip_blocks, loop controls), so prompts
match `AutoTokenizer.apply_chat_template` exactly.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from common.errors import InvalidRequestError, ModelLoadError


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _raise_exception(message: str):
    raise InvalidRequestError(f"chat template error: {message}")


class TextTokenizer:
    def __init__(self, model_dir: str | Path, chat_template_file: str | Path | None = None
                 ) -> None:
        """`chat_template_file`: a Jinja template used instead of the model's own."""
        self.model_dir = Path(model_dir)
        self.chat_template_file = Path(chat_template_file) if chat_template_file else None
        if self.chat_template_file is not None and not self.chat_template_file.is_file():
            raise ModelLoadError(f"no chat template file {self.chat_template_file}")
        path = self.model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"no tokenizer.json in {self.model_dir}")
        self.backend = Tokenizer.from_file(str(path))
        self.config = _read_json(self.model_dir / "tokenizer_config.json")
        self.generation_config = _read_json(self.model_dir / "generation_config.json")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that end generation: generation_config's eos ids plus the tokenizer's eos."""
        ids = self.generation_config.get("eos_token_id", [])
        ids = [ids] if isinstance(ids, int) else list(ids)
        if self.eos_token is not None:
            token_id = self.backend.token_to_id(self.eos_token)
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
        return tuple(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\\ud800" in JSON)
                raise InvalidRequestError("text is not valid Unicode (lone surrogate)") from None
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def chat_template(self) -> str | None:
        if self.chat_template_file is not None:
            return self.chat_template_file.read_text()
        template_file = self.model_dir / "chat_template.jinja"
        if template_file.exists():
            return template_file.read_text()
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    @cached_property
    def _compiled_template(self):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent,
                                                                       ensure_ascii=False)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (as Hugging Face templates name it)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        # The template already writes every special token, as transformers assumes.
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)
