"""Who may ask for what: the node policy, the caller, transient uids."""
