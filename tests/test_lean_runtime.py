"""The runtime serves from a bundle without torch, transformers or the export stage."""
import json
import subprocess
import sys

SCRIPT = """
import json, sys
from specdeploy.runtime import Session
result = Session(sys.argv[1]).generate("The quick brown fox", max_new_tokens=12, draft_len=3)
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'onnx', 'onnxscript')
               or m.startswith('specdeploy.export'))
print(json.dumps({"tokens": len(result.token_ids), "heavy": heavy}))
"""


def test_runtime_never_imports_torch_or_transformers(bundles):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(bundles("llama-self"))], capture_output=True, text=True, check=True
    )
    report = json.loads(out.stdout)
    assert report["tokens"] == 12
    assert report["heavy"] == []
