"""How a step's columns move: row sets through any store, and the actors' side of the data-plane switch."""
