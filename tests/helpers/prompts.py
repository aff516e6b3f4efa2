"""The prompts and chats the reference tests generate from (shared by conftest's fixtures and the tests)."""

from __future__ import annotations

MAX_NEW = 24

_LONG = (
    "Serving a language model to many users at once is mostly a memory problem. Every request keeps the keys "
    "and values of all its previous tokens so that the next token can attend to them, and this cache grows "
    "by a fixed number of bytes per token, per layer and per key-value head. A contiguous reservation sized "
    "for the longest possible conversation wastes most of that memory, because most conversations are short "
    "and nobody knows in advance how long an answer will be. Paging fixes this the way operating systems did "
    "decades ago: memory is cut into small fixed blocks, each sequence keeps a table mapping its logical "
    "blocks to physical ones, and blocks are handed out only when a sequence actually grows into them. "
    "Because every block has the same size, any free block fits any request, so external fragmentation "
    "disappears and the only waste is the unused tail of each sequence's last block. Blocks can also be "
    "shared: two requests that start with the same system prompt can point at the same physical blocks, and "
    "parallel samples of one prompt share everything until they diverge, at which point the shared block is "
    "copied before the first write. The scheduler then decides, step by step, which requests run, which wait "
    "and which must give their memory back when the pool runs dry, either by recomputing later or by moving "
    "its blocks to host memory for a while. In short, the"
)

PROMPT_TEXTS = {
    "short": "Hi",
    "fact": "The capital of France is",
    "story": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "long": _LONG,
    "non_ascii": "東京は日本の首都です。Café, naïve, façade — and a robot 🤖 says:",
    "code": "def fibonacci(n):\n    ",
    "count": "Count from 1 to 10: 1, 2, 3,",
}
CHATS = {
    "chat": [{"role": "user", "content": "Write a haiku about memory."}],
    "chat_multi": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "Stored keys and values of past tokens."},
        {"role": "user", "content": "Why page it?"},
    ],
}


def encode_prompts(tk) -> dict[str, list[int]]:
    """Every prompt and chat as token ids, by name."""
    out = {name: tk.encode(text) for name, text in PROMPT_TEXTS.items()}
    for name, messages in CHATS.items():
        out[name] = tk.encode(tk.apply_chat_template(messages))
    return out
