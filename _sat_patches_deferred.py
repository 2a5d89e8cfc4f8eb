"""Start-up hook of sat_patches, part two: third-party modules that ``import sat`` imports and a fine-tune never uses,
imported when first used instead (run from ``_sat_patches_boot``; imports nothing heavy).

SwissArmyTransformer 0.4.12 imports, at ``import sat``, libraries that a CogVLM fine-tune calls only on request
or in one process: ``wandb`` (``sat/training/deepspeed_training.py``; used with ``--wandb``), ``datasets``
(``sat/data_utils/hf_dataset.py``; used for ``hf://`` data), ``transformers.activations``
(``sat/model/official/gpt2_model.py``, one activation of SAT's GPT-2) and ``requests``
(``sat/resources/download.py``; SAT's model zoo). ``tensorboardX`` (``sat/training/utils.py``) stays as it is: rank 0
of every training run writes summaries with it. Together about 4 s of every process's start-up on a CPU (each rank,
each ``sat-patches`` verb that loads a model); the GPT-2 activation pulls in ``torch.distributed.tensor`` through
transformers. While each of those SAT modules runs its own code, the library it imports is a
:class:`DeferredModule` in ``sys.modules``: a name it binds (``import wandb``, ``from datasets import load_dataset``,
``ACT2FN["gelu_new"]``) is a :class:`Deferred` that imports the real library at its first use (a call, an
attribute, an item) and behaves as the real object from then on. Nothing else sees the placeholders: each leaves
``sys.modules`` when the SAT module's code is done, and a library already imported is used as it is. Off with
``SAT_PATCHES_DISABLE=deferred_imports``.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

PATCH_NAME = "deferred_imports"
# SAT module -> the libraries its own code imports at ``import sat`` and uses only on request
DEFERRED = {
    "sat.training.deepspeed_training": ("wandb",),
    "sat.data_utils.hf_dataset": ("datasets",),
    "sat.model.official.gpt2_model": ("transformers.activations",),
    "sat.resources.download": ("requests",),       # downloads of SAT's model zoo
}


def wanted() -> bool:
    disabled = {n.strip() for n in os.environ.get("SAT_PATCHES_DISABLE", "").split(",")}
    return not ({PATCH_NAME, "all"} & disabled)


class Deferred:
    """A value from a library not imported yet: ``module`` and the steps from it (attribute names, items). Its
    first use imports the library and takes those steps; every use after that is the real value's."""
    __slots__ = ("_module", "_steps", "_value", "_binding")

    def __init__(self, module, steps, binding):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_steps", tuple(steps))
        object.__setattr__(self, "_value", _UNSET)
        object.__setattr__(self, "_binding", binding)  # [True] while the SAT module's code runs (shared)

    def _real(self):
        value = object.__getattribute__(self, "_value")
        if value is _UNSET:
            name = object.__getattribute__(self, "_module")
            if isinstance(sys.modules.get(name), DeferredModule):  # used while the SAT module still runs its code
                del sys.modules[name]
            value = importlib.import_module(name)
            for kind, key in object.__getattribute__(self, "_steps"):
                value = getattr(value, key) if kind == "attr" else value[key]
            object.__setattr__(self, "_value", value)
        return value

    def _step(self, kind, key):
        """While the SAT module binds names (its import), another step is deferred too; after, it is taken."""
        if object.__getattribute__(self, "_binding")[0]:
            return Deferred(object.__getattribute__(self, "_module"),
                            object.__getattribute__(self, "_steps") + ((kind, key),),
                            object.__getattribute__(self, "_binding"))
        real = self._real()
        return getattr(real, key) if kind == "attr" else real[key]

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            # what introspection probes (__wrapped__, markers): answered without importing the library
            raise AttributeError(name)
        return self._step("attr", name)

    def __getitem__(self, key):
        return self._step("item", key)

    def __call__(self, *args, **kwargs):
        return self._real()(*args, **kwargs)

    def __contains__(self, item):
        return item in self._real()

    def __iter__(self):
        return iter(self._real())

    def __len__(self):
        return len(self._real())

    def __repr__(self):
        steps = "".join(f".{k}" if kind == "attr" else f"[{k!r}]"
                        for kind, k in object.__getattribute__(self, "_steps"))
        return f"<deferred {object.__getattribute__(self, '_module')}{steps}>"


_UNSET = object()


class DeferredModule(type(sys)):
    """The library's place in ``sys.modules`` while one SAT module's code runs: the importer binds it (or names
    from it, as :class:`Deferred` values) without importing it."""

    def __init__(self, name, spec, binding):
        super().__init__(name)
        self.__spec__ = spec  # the real one: importlib.util.find_spec(name) still answers
        self.__sat_patches_deferred__ = Deferred(name, (), binding)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # what the import system probes (__path__, __file__, ...)
        return getattr(self.__sat_patches_deferred__, name)


def binding_names(module_name: str):
    """``with`` block: the libraries of :data:`DEFERRED` for ``module_name`` (those not imported already) are
    placeholders in ``sys.modules``; the SAT module's globals keep what they bound."""
    return _Binding(module_name)


class _Binding:
    def __init__(self, module_name):
        self.libraries = [n for n in DEFERRED.get(module_name, ()) if n not in sys.modules]
        self.binding = [True]
        self.placed = {}

    def __enter__(self):
        for name in self.libraries:
            top = name.partition(".")[0]  # (a submodule's own spec would import its package)
            try:
                installed = importlib.util.find_spec(top) is not None
            except (ImportError, ValueError):
                installed = False
            if not installed:
                continue  # not installed: SAT's own import says so, as before
            spec = importlib.util.find_spec(name) if top == name else importlib.machinery.ModuleSpec(name, None)
            placeholder = DeferredModule(name, spec, self.binding)
            sys.modules[name] = self.placed[name] = placeholder
        return self

    def __exit__(self, *exc):
        self.binding[0] = False
        for name, placeholder in self.placed.items():
            if sys.modules.get(name) is placeholder:
                del sys.modules[name]
        return False


def found_elsewhere(finder, fullname: str):
    """The spec the other finders give for ``fullname`` while ``finder`` (a meta path finder with a ``_finding``
    flag) steps aside, or None where its loader cannot be wrapped (no ``exec_module``)."""
    finder._finding = True
    try:
        spec = importlib.util.find_spec(fullname)
    finally:
        finder._finding = False
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return None
    return spec


class DeferringFinder(importlib.abc.MetaPathFinder):
    """Runs the code of each SAT module of :data:`DEFERRED` inside :func:`binding_names`."""

    def __init__(self):
        self._finding = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in DEFERRED or self._finding or not wanted():
            return None
        spec = found_elsewhere(self, fullname)
        if spec is None:
            return None
        run_module = spec.loader.exec_module

        def exec_module(module):
            with binding_names(fullname):
                run_module(module)

        spec.loader.exec_module = exec_module
        return spec


def install():
    if not any(isinstance(f, DeferringFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeferringFinder())
