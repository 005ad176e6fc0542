"""The warm standby: the decision, the warm child, its program, the launch's slot."""
