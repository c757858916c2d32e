"""``ts.torch_handler``: BaseHandler, VisionHandler and ImageClassifier.

TorchServe's other default handlers (image_segmenter, object_detector, text_classifier, ...)
are served by name through ``backend.handlers`` instead; subclassing them is not supported.
"""
