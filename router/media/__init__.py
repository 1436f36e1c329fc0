"""Images a request carries: parsed from each API's parts (ImageRef), fetched,
decoded and resized for one model (PreparedImage), as docs/vision.md describes."""
