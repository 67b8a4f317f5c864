"""The live twin: the same claude-code sessions through the simulator and through live `marsched serve`
configurations, side by side (docs/twin.md)."""
