"""FTRL-Proximal and the optimizers torch.optim lacks (internal: the public face is ``unison.optim``)."""
