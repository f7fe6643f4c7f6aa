"""What a request asks for: sampling, structured-output, pooling and thinking parameters."""
