"""How many tokens each row drafts per step: the adaptive schedule (measured acceptance and step costs decide,
speculation turns off where it does not pay) and the user's batch-size rules. See `controller`. `tree_size` sizes
dynamic trees and n-gram tries from measured verify costs (`tree_total_tokens="auto"`)."""
