"""The JIT build machinery: everything that turns a kernel family's header into a loaded module.

The family wrappers (``sparsekv.jit_kernel.<stem>``) only declare what to build; these modules build it:

* :mod:`.registry` - ``KernelFamily`` (named validation of template arguments before any compile),
  ``register`` and ``discover``;
* :mod:`.loader` - a family instance -> build plan -> cached module (``load_jit``), the glue it generates;
* :mod:`.cache` - the content-addressed cache: keys, locks, atomic publish, verify, prune;
* :mod:`.toolchain` and :mod:`.arch` - the compilers found, and the CUDA archs to build for;
* :mod:`.resources` - how many compiles run side by side;
* :mod:`.bundle` - export and import of built modules (``sparsekv jit export`` / ``import``);
* :mod:`.doctor` - the checks ``sparsekv jit doctor`` prints.

Nothing here imports a wrapper module, except :func:`.registry.discover`, which imports them all so
each registers its families.
"""
