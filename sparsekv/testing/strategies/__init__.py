"""Hypothesis strategies for the kernels' inputs, one module per kernel stem.

Each ``sparsekv.testing.strategies.<stem>`` draws what its kernel takes (shapes at the limits,
unaligned views, page boundaries, the instances of the family's table) and is used with
``@given(data=st.data())`` and ``data.draw(...)`` or directly in ``@given``::

    from hypothesis import given
    from sparsekv.testing.strategies.dsv4_quant import quant_rows

    @given(x=quant_rows())
    def test_my_quantizer(x): ...

Compiles: a strategy may draw an instance not built yet, whose first call compiles for seconds.
Use the ``sparsekv`` hypothesis profile (``deadline=None``) and prebuild the tables: the pytest
plugin sparsekv installs does both (``pytest --sparsekv-prebuild all``; see
:mod:`sparsekv.testing.pytest_plugin`).
"""
