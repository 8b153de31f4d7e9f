"""Building guest images for the microVM host, apart from running them.

The room holds :mod:`.image` (plan and build one image, the face the runtime uses),
:mod:`.root` (the host files its erofs root packs, and staging them), :mod:`.initramfs`
(busybox, kernel modules and ``/init``) with its :mod:`.cpio` writer, :mod:`.selection`
(which installed packages go in), :mod:`.kernel` (finding or fetching the guest kernel)
and :mod:`.image_cache` (where built images live and what evicts them). The runtime
(host, machine, boot templates, the guest agent) sits one level up: it asks for an
image (:func:`.image.build_image`), boots a :class:`.image.GuestImage` and holds it in
the cache while it runs.
"""
