"""``ts.torch_handler``: TorchServe's handler classes, to subclass or to name in a manifest.

BaseHandler, VisionHandler, ImageClassifier, ImageSegmenter, ObjectDetector, TextHandler,
TextClassifier, DenseNetHandler, the DALI, DeepSpeed and PiPPy bases, the TensorRT-LLM and
vLLM handlers, and the request envelopes (``request_envelope``). A manifest naming
``image_classifier``, ``image_segmenter``, ``object_detector`` or ``text_classifier`` gets
batchserve's own built-in (``backend.handlers``, which batches and decodes images faster);
any other name of a module here (``densenet_handler``, ``vllm_handler``, ...) gets this
package's class, as TorchServe resolves handler names.
"""
