"""Moving the accepted path's KV into consecutive slots."""
