"""Regime maps: where MARS beats INFERCEPT, over load × KV capacity × API time."""
