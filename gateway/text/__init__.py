"""Text processing of the gateway tier: tokenizer, chat templates, incremental detokenizer, stop strings.

Everything here is torch-free (tokenizers, jinja2, gguf and the stdlib only), so that a gateway
process starts fast and stays small.
"""

from gateway.text.chat_template import ChatTemplate, ChatTemplateError
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop import StopChecker
from zserve.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "IncrementalDetokenizer", "StopChecker", "Tokenizer"]
