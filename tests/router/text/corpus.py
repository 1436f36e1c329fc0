"""Texts that exercise every branch of the pre-tokenizers: shared by the tokenizer and detokenizer tests."""

from __future__ import annotations

CORPUS: tuple[str, ...] = (
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you're right, they'll know; we'd've said it. She's here, it's OK. I'M LOUD, DON'T",
    "12345",
    "Call 555-0123 at 3:45pm: 1,000,000 items cost $1.99 (or 2.5e-3 BTC); x=42, y = 007",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "\tindented with a tab\n\t\tand two\n    four spaces\n",
    'for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; } // C++ && || != ->',
    "   leading spaces and trailing ones   ",
    "multiple    spaces   between\n\n\nand newlines\r\nand CRLF\n \n  \n",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 heart ❤️",
    "中文字符和标点，还有日本語のテキストと한국어 텍스트",
    "Ünïcödé naïve café façade Ångström — “quotes” ‘single’ … ½ ² ٣",
    "combining e\u0301 vs é, Straße, ﬁ ligature",
    "Русский текст, ελληνικά, עברית, العربية, हिन्दी भाषा, ภาษาไทย",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\nmid<|im_end|>text<|endoftext|>",
    "URL https://example.com/path?q=1&r=two#frag and email a.b+c@d.org",
    "",
    " ",
    "\n",
    "a  1  22   333",
)
