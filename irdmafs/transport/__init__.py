"""Remote memory as a device: one interface (``base``), one sans-IO wire format (``protocol``),
three implementations (``memory``, ``tcp``, ``verbs``) and the choice between them."""
